"""Evaluation: benchmark definitions (GSM8K, Geometry3K, user-defined), the runner, metrics, reports."""
