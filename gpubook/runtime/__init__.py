"""gpubook's runtime: container engines, templates, the NVIDIA driver injection and SSH access.

`runtime` never imports `scheduler`; the scheduler decides *when*, the runtime knows *how*.
"""
