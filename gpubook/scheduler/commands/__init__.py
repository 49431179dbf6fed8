"""The commands a person runs: `gpubook ...`, the demo, doctor. Nothing below imports this layer."""
