"""How a job runs: which launcher started it (launch_env.py: torchrun, DeepSpeed, Slurm, MPI) and
the process group and device it works in (session.py). Used by the trainer and the tools alike."""
from .launch_env import LaunchEnv, detect_launch_env, init_distributed, strip_launcher_args
from .session import is_launched, process_group, resolve_device

__all__ = ["LaunchEnv", "detect_launch_env", "init_distributed", "strip_launcher_args", "is_launched",
           "process_group", "resolve_device"]
