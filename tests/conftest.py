import os

# Offline, loopback-only, in-process engine: set before vLLM is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The Triton interpreter runs kernels on CPU tensors; vLLM disables Triton on CPU either way.
os.environ.setdefault("TRITON_INTERPRET", "1")
