"""Weights changed in place: every donor computed before is wrong for the new weights.

Training loops sync new weights into a running engine (reinforcement learning), then reset
vLLM's prefix cache with ``reset_prefix_cache()``, which resets no connector (TRL calls it
so). Donors of the old weights would be served over the new ones, a wrong answer with no error.
So the worker half must see every update it can:

- ``install()`` wraps the weight-update calls of vLLM's worker class (``reload_weights``, and
  ``update_weights`` / ``finish_weight_update`` of its weight-transfer engines, some of which
  copy into the parameters without ``load_weights``);
- ``watch(model)`` wraps the loaded model's ``load_weights`` (what TRL's, OpenRLHF's and
  verl's syncs call from their worker extensions, and vLLM's reload inside);
- ``model_hook`` counts the model runners' own ``reload_weights`` (``count_calls``) and reports
  a model loaded again (``changed``).

Each bumps this process's ``generation()``, which the worker half compares at every step (a
counter: nothing is hashed, nothing waits). Each wrapper bumps even when the call raises (the
weights may be half written). Not seen: weights written into the parameters directly
(``param.copy_``); such a loop must reset the connector (``reset_prefix_cache(
reset_connector=True)``, a pause with ``clear_cache``, or sleep).

Touches ``vllm.v1.worker.gpu_worker.Worker`` (the CPU worker subclasses it), whose four
methods are the same in vLLM 0.32 and 0.33, and the model class's ``load_weights``. Counted
though they change nothing: a drafter-only update, a call that fails its precondition, 0.33's
sharded-RDT engine setup (``load_weights`` over meta tensors); each costs the donors only.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os

from semshare_vllm.vllm_compat import on_import

logger = logging.getLogger("vllm.semshare")

PLUGIN = "semshare"  # our vllm.general_plugins entry point's name (pyproject.toml)
WORKER = ("vllm.v1.worker.gpu_worker", "Worker")
# ``reset_weights`` zeroes them (0.33's ``/weight_checker`` "reset"), a sync follows
METHODS = ("reload_weights", "update_weights", "finish_weight_update", "reset_weights")

_updates = itertools.count(1)
_generation = 0


def generation() -> int:
    """How many weight updates this process has seen."""
    return _generation


def changed() -> None:
    global _generation
    _generation = next(_updates)  # atomic under the GIL: two bumps never count as one


def _counting(original):
    if getattr(original, "_semshare_counts_updates", False):
        return original

    @functools.wraps(original)
    def call(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            changed()

    call._semshare_counts_updates = True
    return call


def count_calls(cls, name: str) -> bool:
    """Count each call of ``cls.name`` (defined on that class) as a weight update."""
    method = cls.__dict__.get(name)
    if method is None:
        return False
    setattr(cls, name, _counting(method))
    return True


def _wrap_worker(module) -> None:
    cls = getattr(module, WORKER[1], None)
    for name in METHODS:
        if cls is None or not count_calls(cls, name):
            logger.warning(
                "SemShare: vLLM's %s.%s has no %s: weight updates through it are not seen "
                "(reset the connector after one)",
                *WORKER,
                name,
            )


def plugin_left_out() -> str | None:
    """Why the model's ``load_weights`` will go unseen in this engine, or None: vLLM loads our
    plugin (the entry point ``PLUGIN``, which wraps the model as it loads) unless
    ``VLLM_PLUGINS`` lists plugins without it. Such an engine persists and shares nothing
    (``KVGeometry.local_only``): a sync through ``load_weights`` would otherwise leave donors of
    other weights under the checkpoint's fingerprint."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or PLUGIN in allowed.split(","):
        return None
    return (
        f"VLLM_PLUGINS leaves out the {PLUGIN!r} plugin: weight updates through the model's "
        "load_weights are not seen"
    )


def install() -> None:
    """Wrap the worker's weight-update calls, now or when its module is imported. Cheap,
    idempotent, never raises. The plugin entry point calls it, and the worker half again (vLLM
    may not load our plugin: a ``VLLM_PLUGINS`` allowlist)."""
    try:
        on_import.when_imported(WORKER[0], _wrap_worker)
    except Exception:
        logger.warning("SemShare: could not watch vLLM's weight updates", exc_info=True)


def watch(model) -> None:
    """Count every call of this model's ``load_weights`` as a weight update. Wrapped on the
    class that defines it, not on the instance (which a copy or a pickle of the model would
    carry): every model of that class in this process counts, which only costs donors."""
    owner = next((c for c in type(model).__mro__ if "load_weights" in c.__dict__), None)
    try:
        if owner is not None:
            count_calls(owner, "load_weights")
    except Exception:
        logger.warning(
            "SemShare: cannot watch %s.load_weights: weight updates through it are not seen",
            type(model).__name__,
            exc_info=True,
        )
