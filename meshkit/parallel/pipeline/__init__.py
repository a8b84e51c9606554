"""Pipeline parallel: blocks split into stages (`stages`, `hf_stage`), the schedule that runs them (`schedule`)
and weights tied across stages (`tied`)."""
