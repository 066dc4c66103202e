"""Readers for files reprlab did not write: bounded, with errors that name the file and line."""
