"""Lightning strategies; importing this registers ``strategy="recover_hsdp"``."""

from lightning_recover.strategies.recover_hsdp import ConfigurationError, ReCoVerHSDPStrategy, StepTicket

__all__ = ["ConfigurationError", "ReCoVerHSDPStrategy", "StepTicket"]
