"""TPUs' backend: Pallas (Mosaic) kernels behind the models' `Kernels` seam (`kernels.TpuKernels`)."""
