"""Expert parallelism: mixture-of-experts layers whose experts are split over the expert-parallel group."""
