"""Running on a Ray cluster: jobs through the Ray Jobs API (`jobs`)."""
