"""Context parallel: the sequence split over `cp` ranks (`apply`), ring attention on any backend
(`ring_attention`) and inside `transformers` models (`hf`)."""
