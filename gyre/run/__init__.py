"""The run host both topologies share (`host`), what it builds from the config (`build`), what a run
directory already holds (`history`), the state its actuators read (`live`) and its console lines (`console`)."""
