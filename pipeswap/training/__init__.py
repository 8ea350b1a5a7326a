"""Training in every mode from one typed config: data parallel with swapping, pipelines, emulation."""

from pipeswap.training.report import REPORT_FORMAT, load_report
from pipeswap.training.run import TrainingStopped, TrainOutcome, train

__all__ = ["REPORT_FORMAT", "TrainOutcome", "TrainingStopped", "load_report", "train"]
