"""Who the device is and which server it trusts: its key, its enrolment, the pinned server certificate."""
