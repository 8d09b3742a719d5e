"""Running on a Ray cluster: jobs through the Ray Jobs API (`jobs`), a running job's control actor
(`control`, `asyncrl scale`) and one placement group per pool (`placement`)."""
