//! Decision quality: accuracy and regret (being written).
