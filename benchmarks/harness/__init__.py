"""Code that only benchmarks and their tests use: load shapes (soak), the autoscaling rule evaluator (scaling)."""
