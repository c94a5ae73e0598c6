"""Lightning strategies; importing this registers ``strategy="recover_hsdp"``.

  recover_hsdp    ReCoVerHSDPStrategy: Lightning's hooks, delegating to the step engine
  environment     ReplicaEnvironment: a rank of the MPI world as Lightning sees it
  replica_group   torch's default process group made replica-local
  sharding        FSDP2 inside a replica (summing), local shards
  probes          watchdog progress and fault-injection points of a step
  checkpoint_io   the fallback checkpoint's file layout
  step_logs       self.log inside a step: reduced once, at the commit
  evaluation_loader  validation/test/predict batches split across live replicas
"""

from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.feed.data import StepTicket
from lightning_recover.strategies.recover_hsdp import ReCoVerHSDPStrategy

__all__ = ["ConfigurationError", "ReCoVerHSDPStrategy", "RecoverConfig", "StepTicket"]
