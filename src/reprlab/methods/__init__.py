"""One folder per method; each has ``recipes/*.yaml`` that ``reprlab recipes`` discovers."""
