"""The constrained types the settings' fields share."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
