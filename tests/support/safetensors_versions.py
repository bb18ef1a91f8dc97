"""A child script's first lines that make safetensors behave as before 0.8 when its second
argument says "before-0.8": no ``backend`` argument (no ``pread``; files are mapped)."""

AS_VERSION = """
import sys
import safetensors, safetensors.torch
if sys.argv[2] == "before-0.8":
    def without_backend(original):
        def call(*args, backend=None, **kwargs):
            if backend is not None:
                raise TypeError("unexpected keyword argument 'backend'")
            return original(*args, **kwargs)
        return call
    safetensors.torch.load_file = without_backend(safetensors.torch.load_file)
    safetensors.safe_open = without_backend(safetensors.safe_open)
"""
