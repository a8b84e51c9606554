"""Expert parallelism: each mixture-of-experts block's experts split over `ep` ranks, tokens sent by all-to-all."""
