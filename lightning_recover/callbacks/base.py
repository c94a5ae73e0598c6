"""``RecoveryCallback``: a Lightning ``Callback`` that also receives the recovery hooks.

Subclass it and override any of the hooks documented in
:mod:`lightning_recover.recovery.hooks` (``on_world_repaired`` to alert on a lost replica,
``on_step_committed`` to log the ledger record, ...). The step engine calls them as typed
methods on every callback in ``trainer.callbacks`` that is a ``RecoveryHooks`` -- this class
is the way to be one -- so subclassing is required: nothing is looked up by name, and the
strategy refuses a plain ``Callback`` that defines a recovery hook's method.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from lightning_recover.recovery.hooks import RecoveryHooks


class RecoveryCallback(Callback, RecoveryHooks):
    """A Lightning callback with no-op recovery hooks to override."""
