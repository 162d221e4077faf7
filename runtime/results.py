from moecc_runtime.job.results import *  # noqa: F401,F403  shim, removed by the lead
