"""Files and batches: one Serve deployment on the Ray head node around their store (shunter.batch_store) and
their bytes (shunter.batch_files)."""
