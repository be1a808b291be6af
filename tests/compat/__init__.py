"""Compatibility tests against the real TRL 1.16 (issue #27): the same script run through TRL's
trainers and swiftune's, compared step by step. Skipped where TRL is not installed."""
