"""The foundations the stages and services stand on: loading and building checkpoints (``models``), corpora and the
tokenizer (``data``, ``tokenizer``), the artifacts' files (``checkpoints``, ``h5files``, ``selection_file``,
``artifacts``), logging and atomic writes (``runtime``), per-layer key widths (``budgets``), the slicing of a
mixer's rows (``slicing``) and the summary at the end of a workflow run (``run_report``)."""
