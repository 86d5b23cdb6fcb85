"""The usage ledger: one Serve deployment on the Ray head node around the SQLite store (shunter.usage_ledger)."""
