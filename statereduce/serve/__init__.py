"""Serving engines: statereduce's checkpoints in vLLM, checked against transformers, and what the engine allocates
for them (docs/serving.md). :mod:`~statereduce.serve.engine` runs in statereduce's environment and never imports vLLM;
:mod:`~statereduce.serve.vllm_worker` runs in the serving environment and imports nothing of statereduce."""
