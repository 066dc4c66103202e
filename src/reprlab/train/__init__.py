"""Training utilities shared by the methods: seeding, schedules, progress bars, distributed helpers."""
