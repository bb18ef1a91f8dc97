# semshare-vllm on a GPU host: vLLM 0.33 (CUDA) + the connector.
#   docker build -t semshare-vllm .
#   docker run --gpus all -p 8000:8000 semshare-vllm Qwen/Qwen2.5-7B-Instruct
# CPU-only hosts: Dockerfile.cpu.
FROM vllm/vllm-openai:v0.33.0
WORKDIR /opt/semshare-vllm
COPY pyproject.toml README.md ./
COPY src ./src
# With its dependencies (MiniLM and its runners, FAISS, rapidfuzz, onnxruntime-gpu); the image's
# vLLM 0.33 and torch already satisfy the [gpu] extra and stay as they are.
RUN pip install --no-cache-dir ".[gpu]"
ENTRYPOINT ["vllm", "serve", "--kv-transfer-config", \
  "{\"kv_connector\":\"SemShareConnector\",\"kv_connector_module_path\":\"semshare_vllm.connector\",\"kv_role\":\"kv_both\"}"]
