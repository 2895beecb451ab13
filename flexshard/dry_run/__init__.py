"""Reports on a model, wrapped or about to be: `describe` (the plan flex_shard
made, or a dry run of the plan it would make) and `plan_buckets` (BucketSpecs
under a byte budget, measured from the module). Above runtime: they read a
wrapped model's state; planning/ below only computes plans."""
