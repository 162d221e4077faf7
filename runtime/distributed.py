from moecc_runtime.job.distributed import *  # noqa: F401,F403  shim, removed by the lead
