"""Serve app builders and deploy configs (``serve run serve_apps.<app>:app_builder`` / ``serve deploy <yaml>``)."""
