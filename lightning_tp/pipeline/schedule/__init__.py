"""Pipeline schedules as pure data: building, replaying, time slots, when a send has landed."""
