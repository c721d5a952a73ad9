"""What a run is judged by: its record (events, injections), the measurements taken from it,
and the checker's verdict."""
