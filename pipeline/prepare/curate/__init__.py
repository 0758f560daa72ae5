"""Curation stages of pipeline.prepare: language identification, quality filters, PII,
near-duplicates, decontamination."""
