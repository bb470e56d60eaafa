"""Utilities every floor uses: file access on local disks and gs:// (`fileio`), host memory
(`hostmem`), and the commands' shared plumbing (`cli`)."""
