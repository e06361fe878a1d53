"""The built-in callbacks. Stack them in a list, in the order they should run.

The display callbacks (`TensorBoard`, `ProgressBar`, `ModelSummary`, `Profiler`) import
tensorboard, rich and torchinfo only when a fit uses them; the experiment trackers
(`WandbLogger`, `MLflowLogger`, optional extras) import wandb and mlflow the same way. The speed callbacks
(`Compile`, `CudaSpeedups`, `ThroughputMonitor`, `MemoryMonitor`) are in
docs/performance.md.
"""

from __future__ import annotations

from hookloop.callbacks.activation_checkpointing import ActivationCheckpointing
from hookloop.callbacks.amp import AMP
from hookloop.callbacks.checkpoint import Checkpoint
from hookloop.callbacks.compile import Compile
from hookloop.callbacks.csv_logger import CSVLogger
from hookloop.callbacks.cuda_speedups import CudaSpeedups
from hookloop.callbacks.ddp import DDP
from hookloop.callbacks.detect_anomaly import DetectAnomaly
from hookloop.callbacks.early_stopping import EarlyStopping
from hookloop.callbacks.fault_tolerance import FaultTolerance
from hookloop.callbacks.ema import EMA
from hookloop.callbacks.fsdp import FSDP
from hookloop.callbacks.grad_accumulation import GradAccumulation
from hookloop.callbacks.grad_clip import GradClip
from hookloop.callbacks.lr_scheduler import LRScheduler
from hookloop.callbacks.memory import MemoryMonitor
from hookloop.callbacks.metrics import Metrics
from hookloop.callbacks.mlflow_logger import MLflowLogger
from hookloop.callbacks.model_summary import ModelSummary
from hookloop.callbacks.profiler import Profiler
from hookloop.callbacks.progress import ProgressBar
from hookloop.callbacks.short_run import ShortRun
from hookloop.callbacks.tensor_parallel import TensorParallel
from hookloop.callbacks.tensorboard import TensorBoard
from hookloop.callbacks.terminate_on_nan import TerminateOnNaN
from hookloop.callbacks.throughput import ThroughputMonitor
from hookloop.callbacks.time_limit import TimeLimit
from hookloop.callbacks.timer import Timer
from hookloop.callbacks.wandb_logger import WandbLogger

__all__: list[str] = []
__all__ += ["AMP", "EMA", "GradAccumulation", "GradClip", "LRScheduler"]
__all__ += ["Checkpoint", "EarlyStopping", "Metrics", "TerminateOnNaN"]
__all__ += ["DetectAnomaly", "ShortRun", "TimeLimit", "Timer"]
__all__ += ["ActivationCheckpointing", "DDP", "FSDP", "FaultTolerance", "TensorParallel"]
__all__ += ["CSVLogger", "ModelSummary", "Profiler", "ProgressBar", "TensorBoard"]
__all__ += ["Compile", "CudaSpeedups", "MemoryMonitor", "ThroughputMonitor"]
__all__ += ["MLflowLogger", "WandbLogger"]
