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


def run_as_version(script: str, directory, version: str) -> tuple[int, str, str]:
    """Run ``AS_VERSION + script`` in a child process (a SIGBUS kills the child only) with the
    arguments ``directory`` and ``version``: its return code, stdout and stderr."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", AS_VERSION + script, str(directory), version],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout.strip(), proc.stderr
