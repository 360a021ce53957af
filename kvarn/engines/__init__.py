"""What `kvarn bench` and `kvarn eval` share to run a model: GPU discovery (gpus), vLLM engine arguments per KV
format (vllm_args), the one vLLM worker process (vllm_worker) and the reading of its log (vllm_log), process-group
handling (process) and the transformers KV cache per format (hf).

Imports neither kvarn.bench nor kvarn.eval, and vLLM, torch and transformers only where they run.
"""
