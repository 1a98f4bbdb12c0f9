"""The web UI and Grafana dashboards over lightspan's store and metrics."""
