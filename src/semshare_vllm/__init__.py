"""semshare-vllm: serve a prompt's prefill from the KV cache of an earlier, similar prompt.

The connector class vLLM loads is ``semshare_vllm.connector.SemShareConnector``. Importing this
package loads nothing heavy.
"""

__version__ = "0.4.0"
