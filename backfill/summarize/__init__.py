"""Summarisation jobs as users have them: a dataset of documents in, a dataset of summaries out.

The pure core, no I/O beyond the files a caller names:

* :mod:`.documents`: what a source yields, one :class:`~.documents.Document` or one
  :class:`~.documents.RowError` per row, and the checks every reader shares (ids, empty text);
* :mod:`.folder` and :mod:`.tables`: streaming readers for a folder of ``.txt``/``.md``/
  ``.html`` files and for JSONL, CSV and Parquet files;
* :mod:`.chunks`: a document too long for the model's context split into chunks that fit, on
  paragraph and sentence boundaries where possible, every character kept;
* :mod:`.reduce_plan`: how chunk summaries combine into one summary per document (more levels
  when they do not fit one), and which reduce steps are ready to run;
* :mod:`.writer`: the results, source ids with their summaries, written as Parquet, CSV or
  JSONL a batch of rows at a time.
"""
