"""Placeholder module: rules are added here."""
