"""Lightning strategies; importing this registers ``strategy="recover_hsdp"``.

  recover_hsdp    ReCoVerHSDPStrategy: Lightning's hooks only, each delegating
  steps           training_step / backward / optimizer_step over the step engine
  train_loader    the step tickets Lightning iterates; microbatches loaded ahead
  step_logging    Lightning's logging through a step: as-batch, capture, leader logs
  metrics         reduce / all_gather and torchmetrics' syncs across the live replicas
  checkpoint_hooks  the checkpoint hooks: leader-only save, load and the job's resume
  trainer_setup   the Trainer's checks, the protocol's callbacks, the job's host
  environment     ReplicaEnvironment: a rank of the MPI world as Lightning sees it
  replica_group   torch's default process group made replica-local
  sharding        FSDP2 inside a replica (summing), local shards
  probes          watchdog progress and fault-injection points of a step
  checkpoint_io   the fallback checkpoint's file layout
  synced_logs     self.log inside a step: reduced once, at the commit
  step_metrics    torchmetrics states updated in a step: summed once per microbatch, at the commit
  evaluation_loader  validation/test/predict batches split across live replicas, the evaluation steps
"""

from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.feed.data import StepTicket
from lightning_recover.strategies.recover_hsdp import ReCoVerHSDPStrategy

__all__ = ["ConfigurationError", "ReCoVerHSDPStrategy", "RecoverConfig", "StepTicket"]
