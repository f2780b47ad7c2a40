"""Gemma's chat formats: tool declarations, tool calls, thinking (token-level structure)."""
