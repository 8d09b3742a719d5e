"""Running on a Ray cluster: jobs through the Ray Jobs API (`jobs`), a running job's control actor
(`control`, `asyncrl scale`), one placement group per pool (`placement`), and who may call the run's HTTP
surfaces, the dashboard and the OpenAI endpoint (`http_guard`)."""
