"""`lmsys plan`: predict per-GPU memory and step time of a training run for any mesh and cluster, and
hold the predictions against measured runs. Torch-free, except calibration and validation."""
