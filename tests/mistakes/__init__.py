"""Exercise files with natural mistakes (and cheats) planted, one per task they target: the
exercise's functions with the exercise's docstrings left out (lessons 10-12; lesson 11's
share the correct helpers of ``lesson11_given``), or (lessons 13 and 14) a solved exercise
imported and the mistaken functions redefined. What the exercise itself gives the student is
taken from it (``given``).

Each ``lessonNN_*.py`` says in its docstring which slip sits in which task; the lesson's
grader test (``tests/test_grader_lessonNN.py``) grades it and holds every planted task to 0
with a message naming the slip.
"""
