"""Benchmarks against published results (Alpa's paper): its data and cases (`alpa`), the run,
checks and ablation (`harness`), tables (`report`) and the V100 calibration fit (`calibrate`).
Only the CLI's `reproduce` command and scripts/ import it; the planner never does."""
