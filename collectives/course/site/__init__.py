"""The site's side of the course: claims and claim_pages (sentences from records), numbers (every
hand-written number held to its record), plots, trace_player, labs."""
