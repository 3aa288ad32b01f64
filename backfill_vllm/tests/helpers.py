"""A vLLM scheduler with no model: a config from a bare ``config.json``, synthetic requests
and a stand-in for the model runner that samples one token per finished prefill or decode
(the way vLLM's own tests/v1/core/utils.py drive ``Scheduler``)."""

from __future__ import annotations

import functools
import json
import queue
import tempfile
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from backfill_vllm.scheduler import BackfillScheduler
from backfill_vllm.settings import SchedulerSettings

BLOCK = 16
TOKEN = 7
BATCH, INTERACTIVE = 10, 0
_HASH = get_hash_fn_by_name("sha256")
init_none_hash(_HASH)


@functools.cache
def _model_dir() -> str:
    folder = Path(tempfile.mkdtemp(prefix="backfill-vllm-test-"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 1024,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    return str(folder)


@functools.cache
def _model_config() -> ModelConfig:
    return ModelConfig(model=_model_dir(), dtype="float32", seed=0, skip_tokenizer_init=True)


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    budget: int = 512,
    num_blocks: int = 1000,
    settings: SchedulerSettings | None = None,
    stock: bool = False,
    async_scheduling: bool = False,
    policy: str = "priority",
    chunked_prefill: bool = True,
    max_model_len: int = 2048,
) -> Any:
    """A ``BackfillScheduler`` (or with ``stock`` vLLM's own) over ``num_blocks`` KV blocks."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked_prefill,
        policy=policy,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    config = VllmConfig(
        scheduler_config=scheduler_config, model_config=_model_config(), cache_config=cache_config
    )
    # VllmConfig turns async scheduling off where the executor lacks it (this CPU); the
    # scheduler under test only needs the flag.
    config.scheduler_config.async_scheduling = async_scheduling
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    kwargs: dict[str, Any] = dict(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=BLOCK,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )
    if stock:
        return (AsyncScheduler if async_scheduling else Scheduler)(**kwargs)
    return BackfillScheduler(settings=settings or SchedulerSettings(), **kwargs)


_seq = iter(range(1, 1 << 30))


def make_request(
    request_id: str,
    *,
    prompt: int,
    priority: int,
    max_tokens: int = 8,
    arrival: float | None = None,
    seed: int | None = None,
    shared_prefix: int = 0,
) -> Request:
    """A request whose prompt no other request shares (no prefix-cache hits between them), or
    whose first ``shared_prefix`` tokens every request made with the same length shares."""
    salt = next(_seq)
    head = [(7 * i) % 1000 + 1 for i in range(min(shared_prefix, prompt))]
    return Request(
        request_id=request_id,
        prompt_token_ids=head + [(salt * 31 + i) % 1000 + 1 for i in range(prompt - len(head))],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed),
        pooling_params=None,
        arrival_time=arrival if arrival is not None else float(salt),
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK, _HASH),
    )


def run_step(scheduler: Any) -> SchedulerOutput:
    """Schedule one step and feed back what a model would: one token for each request whose
    prefill is done (or that decoded)."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[i].is_prefill_chunk else [TOKEN] for i in ids]
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: n for n, r in enumerate(ids)},
            sampled_token_ids=sampled,
        ),
    )
    return output


def blocks_of(scheduler: Any, request_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request_id)[0])


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class StandInExecutor:
    """Stands in for vLLM's model executor under async scheduling (no model, no device): a
    step is handed over by ``execute_model`` and its tokens (one per request whose prefill is
    done, as :func:`run_step`'s) come back from ``sample_tokens``. Records every step with
    tokens in the order the device would run them."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.handed: list[SchedulerOutput] = []
        self._sampled: ModelRunnerOutput | None = None

    def execute_model(self, output: SchedulerOutput, non_block: bool = False) -> Future[Any]:
        if not output.total_num_scheduled_tokens:
            return _done(EMPTY_MODEL_RUNNER_OUTPUT)
        self.handed.append(output)
        ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        self._sampled = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: n for n, r in enumerate(ids)},
            sampled_token_ids=[[] if requests[i].is_prefill_chunk else [TOKEN] for i in ids],
        )
        return _done(None)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Future[Any]:
        return _done(self._sampled)

    def take_draft_token_ids(self) -> None:
        return None


def engine_core(scheduler: Any) -> Any:
    """vLLM's own ``EngineCore`` step loop under async scheduling (its batch queue of two
    steps, ``step_with_batch_queue``) over ``scheduler`` and a :class:`StandInExecutor`:
    nothing but the model and the process around it is left out. Call
    ``core.step_with_batch_queue()`` as vLLM's busy loop does; requests added between calls
    arrive as its input queue would add them."""
    core = EngineCore.__new__(EngineCore)
    core.scheduler = scheduler
    core.model_executor = StandInExecutor(scheduler)
    core.vllm_config = scheduler.vllm_config
    core.batch_queue_size = 2
    core.batch_queue = deque(maxlen=2)
    core.is_mm_encoder_only = False
    core.is_pooling_model = False
    core.log_stats = False
    core.aborts_queue = queue.Queue()
    core._weight_version = "default"
    core.check_for_draft_tokens = False
    return core
