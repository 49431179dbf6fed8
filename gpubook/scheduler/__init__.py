"""gpubook's scheduler: calendar sources, the booking convention, the plan and the daemon."""
