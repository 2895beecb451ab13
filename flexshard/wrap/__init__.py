"""What flex_shard does once, at wrap time, beside planning: reading the mesh, keeping the user's
Parameter objects, watching for params registered later, and a clean exit without destroy_process_group."""
