"""lightning-scale: hybrid data/tensor/pipeline parallelism, fault-tolerant checkpoints and cost
telemetry for PyTorch Lightning."""

__version__ = "0.1.0"
__all__ = ["__version__"]
